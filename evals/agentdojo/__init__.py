"""The model-free AgentDojo evaluation of jaild's information-flow control (issue 42)."""
