"""How long a job takes on a device it does not run on: the engine's scheduling (the real
Scheduler, KV manager and radix cache) driven by a step-cost model instead of a model.

    simulator.py       simulate(requests, engine config, pool, cost) -> SimResult; windows in turn
    step_cost.py       ModelShape, a step's work, StepCost (roofline with fitted Efficiency)
    devices.py         DeviceSpec: datasheet GPUs, this machine's CPU; device names (h100:tp8)
    fit.py             an Efficiency fitted to measured groups of steps
    calibrate.py       this machine's Efficiency, measured on the model's own shapes, cached
    measured.py        a measured device: its file, the calibration cache
    gpu_efficiency.py  batchpage's efficiency on GPUs (its one measured H200 run)
    memory.py          the KV pool an engine gets on a device, a job's peak memory in parts
    capacity.py        a job's rows (a window sample) on one device: preemption, wall time
    estimate.py        plan_capacity: every device asked, and the warnings
    llm_estimate.py    LLM.estimate; output lengths learned from rows generated for real
    options.py         the output-length assumption (max, a length, sample:N)
"""
