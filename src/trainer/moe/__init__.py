"""Mixture-of-experts layers in the trainer: routing (frozen or trained, replayed, measured) and expert parallelism."""
