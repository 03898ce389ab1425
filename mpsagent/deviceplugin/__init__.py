"""The device plugin (`v1beta1.DevicePlugin`): the servicer the kubelet calls (`servicer`), the Register call the
plugin makes to the kubelet (`register_call`), and the endpoint that serves, registers and follows the kubelet's
restarts (`endpoint`)."""
