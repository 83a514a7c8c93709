"""The turnbus worker: the consumer loop, the turn engine, tools and model clients."""
