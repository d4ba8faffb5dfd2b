# The bridge room: a fleet's predictions and presence republished as Home Assistant MQTT discovery and JSON.
