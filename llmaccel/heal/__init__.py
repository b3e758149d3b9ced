"""The heal: training a transformed graph against its source model, a layer above the passes.

heal.py is the `heal` pass (self-distillation; it trains what the passes before it left,
moving and finishing their training forms: Pass.training_form); config.py its options,
data.py its training windows and the domain report, train.py the training step, regions.py
one compiled region per alike decoder layer. The engine reaches it only through the sampler
the frontends hand down (PassContext.sampler).
"""
