-- What a new session of the service's is, for its start-up check
-- (internal/service, openPool): whether it takes writes. A hot standby's
-- sessions do not, nor do those of a role or database whose
-- default_transaction_read_only is on; the service would then start, and
-- fail every batch it stores.
SELECT current_setting('transaction_read_only') = 'on' AS read_only
