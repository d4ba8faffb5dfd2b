# A field device: a camera folder as its pool, a person as its oracle, the label page, stream acquisition.
