# The protocol room: the wire, topics, chunks, the MQTT session, codecs, tensors, options, the model spec; imports no other room.
