"""A clean interrupt: SIGINT (Ctrl-C) or SIGTERM stops every rank at the next step boundary; with --save
the run saves first and rank 0 prints one line naming the iteration, the checkpoint and the command that
resumes; no rank prints a traceback; the printed command resumes with the losses of an uninterrupted
run, bit for bit."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess

import pytest

from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGV = ["--recipe", "recipes/tiny_dense.yaml", "--train-iters", "8", "--log-interval", "1", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--save-interval", "100"]
LINE = re.compile(r"\[interrupted\] (SIG\w+): stopped after iteration (\d+), saved (\S+); resume with: (.*)$", re.M)


@pytest.fixture(scope="module")
def uninterrupted():
    return run_distributed(2, "tests.training.jobs_interrupt:train_history", argv=ARGV)[-1]  # the last rank's losses


def _resumes_exactly(command: str, save: str, iteration: int, reference: list) -> None:
    words = shlex.split(command)
    script = words.index("train.py")
    assert words[script + 1:][-2:] == ["--load", save], command
    resumed = run_distributed(2, "tests.training.jobs_interrupt:train_history", argv=words[script + 1:])[-1]
    assert resumed == reference[iteration:]  # bitwise: the same floats


# a torchrun job starts fresh interpreters (the warm pools cannot receive a launcher's signal)
@pytest.mark.timeout(240)
def test_ctrl_c_under_torchrun_stops_every_rank_saves_and_resumes_exactly(tmp_path, uninterrupted):
    save = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.path.join(ROOT, 'scripts')}", OMP_NUM_THREADS="1")
    torchrun = [os.path.join(ROOT, ".venv", "bin", "torchrun"), "--nproc-per-node", "2", "--log-dir",
                str(tmp_path / "logs"), "--tee", "3", "train.py", *ARGV, "--save", save]
    # its own session: the terminal's Ctrl-C goes to the foreground process group (torchrun's agent;
    # the agent starts each rank in a session of its own and passes the signal on)
    job = subprocess.Popen(torchrun, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    lines = []
    for line in job.stdout:
        lines.append(line)
        if re.search(r"\biteration +1/ +8 \|", line):
            os.killpg(job.pid, signal.SIGINT)
    job.wait(timeout=120)
    log = "".join(lines)
    said = LINE.findall(log)
    assert len(said) == 1, log[-3000:]  # one line, from rank 0
    (said,) = said
    name, iteration, checkpoint, command = said
    iteration = int(iteration)
    assert name == "SIGINT" and 1 <= iteration < 8 and checkpoint == os.path.join(save, f"iter_{iteration:07d}")
    assert os.path.isdir(checkpoint) and command.startswith("torchrun --nproc-per-node 2 train.py ")
    ranks = "".join(open(os.path.join(dirpath, f)).read() for dirpath, _, files in os.walk(tmp_path / "logs")
                    for f in files if f in ("stdout.log", "stderr.log"))
    assert "iteration" in ranks and "Traceback" not in ranks and "KeyboardInterrupt" not in ranks, ranks[-3000:]
    # what torchrun itself prints (docs/reliability.md): its agent's notes and its own SignalException
    assert log.count("Traceback") == 1 and "SignalException: Process" in log and job.returncode == 1, log[-3000:]
    _resumes_exactly(command, save, iteration, uninterrupted)


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step_saves_and_resumes_exactly(tmp_path, uninterrupted):
    save = str(tmp_path / "ckpt")
    out = run_distributed(2, "tests.training.jobs_interrupt:train_signalled", argv=[*ARGV, "--save", save], rank=1, at=2)
    assert [o["iterations"] for o in out] == [[1, 2], [1, 2]]  # rank 1 got it during iteration 2; both stop there
    assert all(o["handlers_restored"] for o in out)
    assert out[0]["stdout"].count("[capabilities]\n") == 1 and "[capabilities]" not in out[1]["stdout"]  # once
    (said,) = LINE.findall(out[0]["stdout"])
    assert not LINE.findall(out[1]["stdout"]) and "Traceback" not in out[0]["stdout"] + out[1]["stdout"]
    assert said[:3] == ("SIGTERM", "2", os.path.join(save, "iter_0000002")) and os.path.isdir(said[2])
    _resumes_exactly(said[3], save, 2, uninterrupted)


def test_the_resume_command_loads_what_was_saved_and_a_ctrl_c_while_starting_is_one_line(monkeypatch, capsys):
    from megatron_ext import errors
    from megatron_ext.training.exits import resume_command

    argv = ["--recipe", "r.yaml", "--load", "base", "--finetune", "--save", "out dir"]
    assert resume_command(argv, "out dir", env={"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}) == \
        "torchrun --nproc-per-node 4 train.py --recipe r.yaml --save 'out dir' --load 'out dir'"
    assert resume_command(["--load=x"], "s", env={}) == "python train.py --load s"

    def starting():
        raise KeyboardInterrupt

    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    with pytest.raises(SystemExit) as stopped:
        errors.run(starting, explain=lambda e: None)
    assert stopped.value.code == 130
    assert capsys.readouterr().err == "[interrupted] SIGINT before a step boundary: stopped, nothing saved\n"
