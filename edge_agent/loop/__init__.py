# The device loop: settings, the round's artefacts and inputs, acquisition, one round's work, the outbox, the agent.
