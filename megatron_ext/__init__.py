"""megatron_ext: what megatron-core lacks, as recipes and small packages around it."""
