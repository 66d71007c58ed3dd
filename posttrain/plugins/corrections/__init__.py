"""Built-in rollout/training mismatch corrections (registered through ``posttrain_register_corrections``)."""
