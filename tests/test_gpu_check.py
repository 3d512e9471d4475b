"""scripts/gpu_check.py --cpu-smoke: every section runs the code it runs on a GPU, at tiny sizes; the
JSON it writes has the schema the GPU run fills, every claim is reported, and what only a GPU can
measure reads "skipped: no CUDA" (never a number)."""
from __future__ import annotations

import json

import pytest

from megatron_ext.offload import MODULES
from scripts import gpu_check

NO_CUDA = "skipped: no CUDA"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = gpu_check.main(["--cpu-smoke", "--out", str(out)])
    files = sorted(p.name for p in out.iterdir())
    doc = json.loads((out / files[0]).read_text())
    return rc, files, doc, buf.getvalue(), (out / files[1]).read_text()


def test_smoke_exits_clean_and_writes_json_and_markdown(smoke):
    rc, files, doc, printed, md = smoke
    assert rc == 0
    assert len(files) == 2 and files[0].endswith("-cpu-smoke.json") and files[1].endswith("-cpu-smoke.md")
    assert files[0][:10] == doc["date"]
    assert printed.strip() == md.strip() and md.startswith("# GPU check: cpu (smoke)")  # stdout: the tables only
    assert doc["schema"] == gpu_check.SCHEMA and doc["mode"] == "cpu-smoke"
    assert {"torch", "megatron_core", "transformer_engine", "commit"} <= set(doc["host"])


def test_every_section_reported(smoke):
    _, _, doc, _, _ = smoke
    sections = doc["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)
    for name, sec in sections.items():
        if name == "transformer_engine":
            assert sec["status"].startswith("skipped: transformer-engine not importable (")
        else:
            assert sec["status"] == "ok", (name, sec.get("traceback"))
        assert isinstance(sec["seconds"], float)
    claims = doc["claims"]
    assert {c["section"] for c in claims} == set(gpu_check.SECTIONS)
    for c in claims:  # measured here and held, or skipped with the reason
        assert c["holds"] is True or c["holds"] in (NO_CUDA, "skipped: not importable"), c


def test_delay_wgrad_compute_dry_run_accepted_as_megatron_allows_it(smoke):
    _, _, doc, _, _ = smoke
    dry = doc["sections"]["transformer_engine"]["delay_wgrad_dry_run"]
    assert dry["accepted"] is True, dry
    assert {"--delay-wgrad-compute", "--overlap-moe-expert-parallel-comm", "transformer_engine"} <= set(dry["argv"])
    te_importable = not doc["sections"]["transformer_engine"]["status"].startswith("skipped: transformer-engine")
    assert dry["transformer_engine"] == ("importable" if te_importable else "assumed (--assume-te)")


def test_cuda_only_values_are_skipped_not_invented(smoke):
    _, _, doc, _, _ = smoke
    s = doc["sections"]
    facts = s["cuda_facts"]
    for key in ("backward_on_other_thread", "threading_local_seen_in_backward", "event_done_right_after_enqueue",
                "event_done_after_synchronize"):
        assert facts[key] == NO_CUDA
        assert key in facts["cpu_platform_observed"]  # what the CPU platform does, labelled as such
    for row in s["multihot"]["rows"]:
        for key in ("cuda_syncs_reference", "cuda_sync_free_ours", "time_reference_ms", "time_ours_ms",
                    "time_ours_over_reference"):
            assert row[key] == NO_CUDA
        assert row["bitwise_equal_at_shape"] is True and row["syncs_detector_ours"] == 0
    for row in s["moe_layer"]["rows"]:
        assert row["cuda_syncs_forward"] == row["cuda_syncs_backward"] == row["step_ms"] == NO_CUDA
        claimed = row["dispatcher"].startswith("multihot") and row["mode"] != "dropless"
        assert row["cuda_sync_free_step"] == (NO_CUDA if claimed else "-")
        assert isinstance(row["syncs_forward"], int) and isinstance(row["syncs_backward"], int)
    for row in s["offload"]["cases"]:
        for key in ("peak_off_bytes", "peak_on_bytes", "saved_bytes", "R", "step_ms_off", "step_ms_on", "step_overhead"):
            assert row[key] == NO_CUDA
        assert row["grads_bitwise_equal"] is True and row["bytes_offloaded_per_step"] > 0
    assert s["offload"]["host_link"] == {"status": NO_CUDA}


def test_sections_cover_what_the_gpu_run_promises(smoke):
    _, _, doc, _, _ = smoke
    s = doc["sections"]
    # every offload module in some set, on its model; every dispatcher x mode on the layer
    assert {m for row in s["offload"]["cases"] for m in row["modules"]} == set(MODULES)
    combos = {(r["dispatcher"], r["mode"]) for r in s["moe_layer"]["rows"]}
    assert combos == {(f"{who}-{d}", m) for who in ("megatron", "multihot") for d in ("alltoall", "allgather")
                      for m in ("dropless", "capacity", "capacity-nopad", "dropless-syncfree")}
    zero_sync = [r for r in s["moe_layer"]["rows"] if r["mode"] == "dropless-syncfree" and r["dispatcher"].startswith("multihot")]
    assert zero_sync and all(r["syncs_forward"] == r["syncs_backward"] == 0 and r["bitwise_equal_to_megatron"]
                             for r in zero_sync)
    assert s["train"]["dense_offload"]["offloaded_bytes"] > 0 and s["train"]["moe_sync_free"]["dispatchers_replaced"] > 0
    gpu = gpu_check.SIZES["gpu"]  # the sizes the GPU run measures at
    assert max(gpu["multihot_tokens"]) == 131072 and max(gpu["multihot_experts"]) == 256
    for shape in gpu["offload"].values():
        assert shape["hidden"] >= 4096 and shape["seq"] >= 4096
    assert "--bf16" in gpu["train_extra"]


def test_a_failing_section_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(size, claims):
        raise RuntimeError("planted")

    monkeypatch.setitem(gpu_check.RUNNERS, "multihot", broken)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = gpu_check.main(["--cpu-smoke", "--out", str(tmp_path), "--sections", "cuda_facts,multihot"])
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert rc == 1
    assert doc["sections"]["multihot"]["status"] == "error: RuntimeError: planted"
    assert doc["sections"]["cuda_facts"]["status"] == "ok"
    assert doc["sections"]["offload"]["status"] == "skipped: not selected"


def test_without_cuda_the_gpu_run_refuses():
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert gpu_check.main([]) == 2
    assert "--cpu-smoke" in err.getvalue()


def test_planner_rows_measured_here_within_5_percent(smoke):
    _, _, doc, _, _ = smoke
    rows = doc["sections"]["planner"]["rows"]
    assert [r["case"] for r in rows] == [c[0] for c in gpu_check.PLAN_CASES]
    for r in rows:
        assert r["measured_by"] == "live tensor bytes (CPU)" and r["measured_peak_bytes"] > 0
        assert abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) <= 0.05 * r["measured_peak_bytes"], r
    # offload predicted and measured to remove bytes
    by = {r["case"]: r for r in rows}
    assert by["dense offload"]["measured_peak_bytes"] < by["dense"]["measured_peak_bytes"]
