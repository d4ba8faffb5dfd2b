# Asynchronous rounds (FedBuff): the versioned intake, the buffer's fold, the version loop.
