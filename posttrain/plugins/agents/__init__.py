"""Built-in agents of the ``openai_agent`` generator (registered through ``posttrain_register_agents``)."""
