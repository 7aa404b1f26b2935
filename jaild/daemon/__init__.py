"""The daemon: admission, placement, jails, the tool broker, and the server shell around them."""
