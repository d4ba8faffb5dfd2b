# Who may talk: the fleet's provisioning (passwords, ACL, keys, TLS) and the embedded broker.
