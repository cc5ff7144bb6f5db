-- What a session is, for every program's start-up check and the readiness
-- of the service and the console (internal/pgconnect): whether it takes
-- writes (a hot standby's sessions do not, nor do those of a role or
-- database whose default_transaction_read_only is on, nor those a primary
-- demoted in place kept open); the isolation level its transactions get
-- when they name none, which the head triggers need to be READ COMMITTED;
-- whether triggers fire at all (session_replication_role = replica
-- switches the head triggers off); which server process it is on, which
-- tells a pooler in transaction mode, whose client moves between server
-- sessions; and whom the server sees at the other end (NULL over a Unix
-- socket), which tells a direct connection from one through a pooler.
SELECT current_setting('transaction_read_only') = 'on' AS read_only,
       current_setting('default_transaction_isolation') AS isolation,
       current_setting('session_replication_role') AS replication_role,
       pg_backend_pid() AS backend_pid,
       host(inet_client_addr()) AS client_addr,
       inet_client_port() AS client_port
