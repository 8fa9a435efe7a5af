"""Making a draft agree more: the teacher dumps (target, self-teacher, draft as given), the training data
and distillation.

May import: the layers below (core, data, models, decoding, serving); not measuring.
"""
