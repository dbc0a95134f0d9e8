"""A local Kubernetes cluster where meshjob's pods run: the real control plane, and a node agent per Node
that does a kubelet's part (containers in network namespaces, in built images or on this machine's files)."""
