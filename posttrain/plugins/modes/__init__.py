"""Built-in run modes (registered through ``posttrain_register_modes``): ``rl``, the loop of
``posttrain.core.loop`` (the default), and ``sft``, supervised fine-tuning on labelled data."""
