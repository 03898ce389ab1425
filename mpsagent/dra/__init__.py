"""The DRA adapter: the service the kubelet's plugin registry asks to register the driver (`registry_service`), the
DRA node service the kubelet calls to prepare and unprepare claims (`node_service`), and the endpoint that serves
both on the kubelet's sockets (`endpoint`); beside them, the API server's side (ResourceSlices and ResourceClaims)
and the CDI files of prepared claims."""
