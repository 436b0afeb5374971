"""The averagers this example is measured against, behind ``run_trainer.py --averager``: ``old_design`` (hivemind's
TrainingAverager driven one round at a time, the design DecentralizedSGD replaces) and ``hivemind_optimizer``
(``hivemind.Optimizer(use_local_updates=True)`` inside VISSL's LARC, what a user would pick instead). Both implement
``vissl_swarm.averaging_protocol.Averaging``; the benchmarks run them beside the default."""
