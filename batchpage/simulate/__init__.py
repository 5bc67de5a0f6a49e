"""How long a job takes on a device it does not run on: the engine's scheduling (the real
Scheduler, KV manager and radix cache) driven by a step-cost model instead of a model.

    simulator.py   simulate(requests, engine config, pool, cost) -> SimResult
    step_cost.py   ModelShape, a step's work, StepCost (roofline with fitted Efficiency)
    devices.py     DeviceSpec: datasheet GPUs, this machine's CPU
"""
