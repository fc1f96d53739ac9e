//! felix-hostile: the hostile-client suite against a real broker over loopback. Work in
//! progress.
