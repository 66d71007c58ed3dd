"""Built-in advantage estimators, one per module (registered through ``posttrain_register_estimators``).

Conventions differ between frameworks; here each one is a documented choice or a named option:

==============================  ==========================================================================
question                        posttrain
==============================  ==========================================================================
which samples form a group      same ``group_index`` (slime groups by position, ``view(-1, n)``)
GRPO std                        Bessel-corrected, ``+ epsilon`` outside the sqrt (slime, verl); option
                                ``normalize_std`` (False = Dr. GRPO's numerator, also ``dr_grpo``)
group of one sample             keeps its raw reward (mean 0, std 1); RLOO and OPO likewise
dense ``token_rewards``         group estimators add their per-sample sum to the outcome (verl);
                                REINFORCE++(-baseline) and GAE add them per token (slime); never ignored
whitening                       REINFORCE++ (both) always, GAE by option ``whiten`` (default on): masked
                                mean, Bessel-corrected variance over the whole batch
loss aggregation                the *loss*'s ``aggregation`` option (``posttrain.core.losses.aggregate``)
==============================  ==========================================================================
"""
