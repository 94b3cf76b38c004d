"""Large models on PyTorch's own engines: the layout, the device mesh, and every parallel step applied to a model.

* dims.py: :class:`ParallelDims` (pp, dp_replicate, dp_shard, cp, tp, ep; from the validated config, once per
  start) and :class:`WorldMesh`, the run's one DeviceMesh, from which every rank index and group is read;
* parallelize.py: ``parallelize(model, dims, mesh, cfg, ...)``, the steps below in one order, with why;
* tensor_parallel.py, expert_parallel.py, compile.py, fsdp.py: the ``apply_*`` steps;
* data_parallel.py: the gradient all-reduce over replicated data-parallel ranks (the training step calls it);
* pipeline.py: pipeline stages cut from the whole model, and torch's schedules over them;
* interleaved.py: several chunks (virtual stages) per pipeline rank, their interleaved schedules, and a process
  group per direction between neighbouring pipeline ranks.

The training loop (training/) assembles a run from these; the graphs that capture it are cuda_graph/'s.
Rules R25-R31 (validation/parallel_rules.py) decide which layouts a config may ask for; docs/parallel.md
describes each layout.
"""
