"""Model-parallel setup from the parsed arguments."""
from __future__ import annotations

from megatron_ext.training import parallel


def initialize_parallel(args) -> None:
    from megatron.core import config

    config.set_experimental_flag(bool(args.enable_experimental))  # as megatron's set_global_variables
    parallel.initialize(
        tensor=args.tensor_model_parallel_size,
        pipeline=args.pipeline_model_parallel_size,
        virtual_pipeline=args.virtual_pipeline_model_parallel_size,
        expert=args.expert_model_parallel_size,
        expert_tensor=args.expert_tensor_parallel_size,
        context=args.context_parallel_size,
        seed=args.seed,
    )
