"""What the stage tests and the GPU tests share: case parameters, calling the
implementation with a scenario, and the rank-side checks more than one test
folder runs. Test modules import from here, never from another test folder."""
