"""Rollout: the SGLang-protocol client, the embedded local engine, weight sync, router and launcher.

Import-light on purpose: import the submodule you need (``posttrain.core.rollout.client`` etc.).
"""
