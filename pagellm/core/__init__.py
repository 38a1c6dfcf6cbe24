"""Plain data that the engine and the model runner share: a request's scheduling state and one step's rows."""
