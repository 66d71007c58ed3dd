"""Training on Megatron-core: model specs, GPTModel build, HF conversion, log-probs, the trainer.

Modules (none is imported here, so ``import posttrain.core.train`` stays light):

- :mod:`~posttrain.core.train.spec`: ``ModelSpec`` / ``DenseGPTSpec``, the interface model plugins implement;
- :mod:`~posttrain.core.train.cpu_shims`: the CPU stand-ins Megatron needs (inactive with CUDA);
- :mod:`~posttrain.core.train.model`: parallel init, ``build_gpt``, ``load_hf``, ``iter_hf``, ``save_hf``;
- :mod:`~posttrain.core.train.attention`: SDPA core attention (GPU without TE, CPU, packed sequences);
- :mod:`~posttrain.core.train.layers`: GLM-4's post-norm wrappers;
- :mod:`~posttrain.core.train.logprobs`: chunked vocab-parallel log-probs and entropy;
- :mod:`~posttrain.core.train.batch`: ``TrainBatch`` and sequence packing;
- :mod:`~posttrain.core.train.trainer`: ``MegatronTrainer`` (actor or critic);
- :mod:`~posttrain.core.train.convert`: ``verify_checkpoint`` and HF <-> Megatron directory conversion.
"""
