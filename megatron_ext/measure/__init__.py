"""Measuring tools shared by the planner and the benchmarks: an independent tracker of live device
bytes (``memtrack``), a fresh world of local processes to run one function on every rank
(``launch``), and megatron's pipeline schedules run without a model on stand-ins (``p2p_programs``).
They import the runtime's packages (platform, seams, schedules), never the benchmarks' helpers (scripts/bench/)."""
