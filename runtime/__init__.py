"""GPU runtime (compressed linears, kernels): arrives with the serving-layout issue."""
