"""Observe: what each step's training looked like, gathered cheaply and folded into the step's one sync.

Mixed precision (a gradient scaler's overflow steps), the zero-grad tracker, parameter norms and update ratios,
the gradients before the loop clips them, which module ran each forward op, the agreement of many processes,
and the module hooks that copies of a model do not carry.
"""
