"""How a jail is started: nsjail per job (spawn) or a fork from a policy's zygote."""
