-- What a session of the service's is, for its start-up check and its
-- readiness (internal/service: takesWrites, reconnectIfReadOnly): whether
-- it takes writes. A hot standby's sessions do not, nor do those of a role
-- or database whose default_transaction_read_only is on, nor those a
-- primary demoted in place kept open.
SELECT current_setting('transaction_read_only') = 'on' AS read_only
