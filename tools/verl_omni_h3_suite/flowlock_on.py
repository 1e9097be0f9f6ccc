"""pytest plugin of tools/verl_omni_h3_suite.sh: verl-omni's own tests with flowlock switched on as a run
switches it on. Before any test module is imported: flowlock's vLLM plugin is registered (the script sets
FLOWLOCK_VLLM_OMNI=strict, as a rollout worker's environment would) and
flowlock.integrations.verl_omni.register is imported, which is what verl-omni's external_lib import does:
its classes replace verl-omni's H3 registrations."""


def pytest_configure(config):
    from flowlock.integrations.vllm_omni import plugin

    plugin.register()
    import flowlock.integrations.verl_omni.register  # noqa: F401
