"""What the tests share: the stub app and its HTTP harnesses, the fault tests' helpers, an
engine run to the end, the Hugging Face reference, tenants, the native-kernel checks, and a
tiny random Llama for the tensor-parallel tests."""
