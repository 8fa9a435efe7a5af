"""Making a draft agree more: the teacher dumps and distillation.

``dump`` (the target's signal written to shards) with ``teacher`` (the target as a teacher),
``self_teacher`` and ``as_given_teacher`` (the other teachers), ``distill_data`` (sequences and batches),
``distill_trainer`` (the loss step: the Trainer and the teacher's head), ``distill`` (the recipe: setup, data,
train, save), ``head_warmup``.

May import: the layers below (core, data, models, decoding, serving); not measuring.
"""
