"""The discrete-event simulator and capacity planner.

- :mod:`~pdserve.sim.profile`: an instance's latency model (step time against the
  step's tokens and context, KV transfer time per byte) and its JSON file;
- :mod:`~pdserve.sim.fit` and :mod:`~pdserve.sim.measure`: fitting that model to
  steps of the real engine (``pdserve profile``);
- :mod:`~pdserve.sim.analytic`: the same model from a GPU's datasheet (peak
  FLOP/s, memory and interconnect bandwidth, efficiencies);
- :mod:`~pdserve.sim.clock`, :mod:`~pdserve.sim.instance`, :mod:`~pdserve.sim.cluster`:
  a whole cluster in virtual time, driving the real engine ``Scheduler`` and
  ``KVCacheManager`` per instance, the router's policy and admission objects and
  the P:D ``Planner`` (``pdserve sim``);
- :mod:`~pdserve.sim.plan`: the cheapest P:D counts and layouts per region that
  meet the SLOs, beside the textbook queueing answer (``pdserve plan``).
"""
