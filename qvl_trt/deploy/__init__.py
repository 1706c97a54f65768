"""What operators deploy: the serving image recipe (image.py) and the Kubernetes manifests
(kubernetes.py) for a generated model repository."""
