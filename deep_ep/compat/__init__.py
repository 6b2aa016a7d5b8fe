"""DeepEP V1's API over ``ElasticBuffer``: the ``Buffer`` façade (``deep_ep.Buffer``, HT and LL), its
handles, V1's ``Config`` with its tuned tables and size hints, and the helpers that map V1's byte
budgets, layout and output shapes onto the core. ``deep_ep`` exports the public names.

Modules, one job each: ``buffer`` (the ``Buffer`` class), ``handles`` (``DispatchHandle``,
``LowLatencyDispatchHandle``), ``config`` (``Config``, ``get_dispatch_config``,
``get_combine_config``, the size hints), ``capacity`` (window bytes and per-call token capacity),
``layout`` (``dispatch_layout``, ``routing_from_ranks``), ``outputs`` (fitting the core's dispatch
outputs to V1's meanings and shapes) and ``streams`` (V1's stream rules for a call's extra work).
"""
