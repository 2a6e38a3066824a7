"""Process start-up: `jax.distributed` initialisation and host/process helpers (`distributed`), the device mesh
and logical-axis sharding rules (`sharding`), platform defaults resolved from `"auto"` config values
(`platform_defaults`), XLA:CPU flags (`xla_flags`), glibc malloc tuning (`host_malloc`) and log-noise filters
(`log_noise`). Nothing here reads a trainer's state.
"""
