"""The drain of the production vLLM unit around the GPU stages (docs/service.md): the service CLI,
its cycle and state, the unit, the GPU holders, the stage wrapper, the watchdog, the environment check."""
