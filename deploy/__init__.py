"""The Ray Serve application of specserve and what deploys it (serve.yaml, RayService, image, dashboard)."""
