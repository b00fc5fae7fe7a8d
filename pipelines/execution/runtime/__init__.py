"""Ray as a sweep runs on it: the environment set before Ray imports (RAY_ENV, the workers' variables, credentials,
the trial driver's resource), this machine's and the cluster's resources, starting and stopping Ray, the hook every
Ray worker runs at start-up, the check of the user's code on a worker, what Ray prints to the terminal, and Ctrl-C /
SIGTERM turned into an orderly stop."""
