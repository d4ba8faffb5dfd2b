# Secure rounds (SecAgg+) on the coordinator: the stage machine, its saved state, the unmasking, the live round.
