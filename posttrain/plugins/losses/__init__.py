"""Built-in policy losses (registered through ``posttrain_register_losses``)."""
