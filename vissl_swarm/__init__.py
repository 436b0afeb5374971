"""What connects VISSL's stock trainer to the swarm, apart from the optimizer itself (``decentralized_sgd/``), the
VISSL task (``decentralized_task.py``) and its hooks (``hooks/``):

- ``vissl_compat``: work-arounds that let VISSL 0.1.6 and classy_vision 0.7.0 run on today's stack (import it before
  anything of VISSL), each naming the upstream issue it covers;
- ``config_loading`` and ``recipe``: a config by name with overrides, and the recipe rescaled to this box's batch;
- ``swarm``: the settings of a box in the swarm, its DHT start and join (``start_dht``), the join line;
- ``dht_rejoin`` with ``address_book``: the DHT found again after an outage or a restart;
- ``swarm_progress``: each box's one signed record (its sample count, which the swarm-wide schedule follows, its
  recipe and the status the monitor shows);
- ``local_replicas``: the broadcasts that keep the GPUs of one box identical; ``ctrl_c``: Ctrl-C at a step boundary;
- ``initial_model``: the run's shared initial weights; ``knn``: the streaming kNN vote of ``run_eval.py``;
- ``preflight``: what ``run_trainer.py --preflight`` measures and advises;
- ``averaging_protocol``: the interface the task and hooks ask of an averager;
- ``local_swarm``: boxes as local ``run_trainer.py`` processes, for ``demo.py``, the tests and the benchmarks.
"""
