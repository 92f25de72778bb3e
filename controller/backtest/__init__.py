"""Trace backtest of scaling policies (`floodgate controller simulate`).

workload  request traces and synthetic days/weeks, with the forecaster's history
engine    the discrete-event replica model; runs any controller, Floodgate's is `decider.decide`
baselines HPA- and KPA-style autoscalers over a plain ReplicaSet
oracle    the zero-wait reference (a yardstick, not a bound) and the two lower bounds (all-served;
          at the SLO goal)
report    side-by-side comparison, tables, plots
"""
