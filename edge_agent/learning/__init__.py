# A device's learning: the model zoo, MC-dropout scoring, samplers, local rules and the learners that train.
