# The fleet's labelling queue: the devices' queries on disk, people's answers stored before devices are told.
