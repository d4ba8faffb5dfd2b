# Coordinator: broker, round state machine, aggregation, storage and the bench simulator.
