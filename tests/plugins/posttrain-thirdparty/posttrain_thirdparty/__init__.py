"""posttrain-thirdparty: backends written against posttrain's public seams only (no ``posttrain.plugins``).

- ``hf_engine``: the ``hf_generate`` engine backend; its server is ``hf_server`` (HF ``transformers``
  forward passes behind SGLang's HTTP API);
- ``torch_trainer``: the ``torch_simple`` trainer backend; its model is ``torch_model`` (plain PyTorch:
  ``AutoModelForCausalLM`` + AdamW, no Megatron).
"""
