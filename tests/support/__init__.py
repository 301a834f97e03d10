"""What the tests share: fakes of the draft's backend and worker, vLLM runs in a
subprocess, and the check that no test's product code swallowed an exception it
did not expect (:mod:`tests.support.swallowed`). Test modules import from here,
never from one another."""
